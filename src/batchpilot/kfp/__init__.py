"""batchpilot as a Kubeflow pipeline: the components (`components`), the pipeline (`pipeline`), compiling
it to YAML (`compile`), running it on this machine with kfp.local (`local`) and submitting it to a KFP
backend (`submit`). The components only convert parameters and call `batchpilot.workflow`."""
