"""Training on meshes: ddp, zero2, fsdp and diloco train steps, multi-host set-up, checkpoints
(re-laid for another mesh on restore)."""
