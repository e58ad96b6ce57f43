"""The conformance matrix's parent process: start engine processes, compare their results,
write the report. Nothing here imports vLLM."""
