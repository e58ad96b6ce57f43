"""What runs in the parent process: start engine processes, compare their results,
write reports. Nothing here imports vLLM."""
