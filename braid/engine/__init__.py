"""Engine: scheduling, KV block management and the step loop."""
