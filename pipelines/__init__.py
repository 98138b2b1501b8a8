"""The batchpilot Kubeflow pipeline and its compiler."""
