"""Command-line tools over the budget records: ``kvctl`` (list, set and clear limits) and
``kvtop`` (a live view). They read and change records only; they never import vLLM."""
