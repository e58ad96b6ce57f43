"""kvcached for vLLM V1 (Model Runner V1).

vLLM activates this through its ``vllm.general_plugins`` entry point
(`kvcached.integration.vllm.plugin:register`). Importing this package is cheap and
imports nothing from vLLM; the submodules that patch vLLM import it themselves.
"""
