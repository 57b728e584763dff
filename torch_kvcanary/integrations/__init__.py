"""Engine integrations: each turns the canary on inside a serving engine (`vllm`)."""
