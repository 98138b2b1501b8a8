"""Node pools and launchers: where and how the trainers of a stage run."""
