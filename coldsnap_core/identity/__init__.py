"""What a payload was captured from and for: the model identity (repository commit, configuration
digest, checkpoint fingerprints and records, the check) and this worker's target identity."""
