"""Training on meshes: ddp, zero2 and fsdp train steps, multi-host set-up, checkpoints."""
