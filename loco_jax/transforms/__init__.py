"""The optax transformations: loco, two_hop, co3 and the baselines."""
