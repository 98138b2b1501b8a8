"""Training: the trainer loop, checkpoints, metrics and the gradient noise scale."""
