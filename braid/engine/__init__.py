"""Engine: scheduler, runner, sampler."""
