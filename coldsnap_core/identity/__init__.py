"""What a payload was captured from and for: the model identity and this worker's target identity."""
