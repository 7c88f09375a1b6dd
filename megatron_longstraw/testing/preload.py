"""Imported by the test fork server (``testing/multiprocess.py``): the transformers reference
models of the built-in families, imported the way ``hf_reference.hf_model_class`` imports them
(without fla on a machine without a GPU), so that a rank or a script forked from the server
does not import them again (about 3 s each)."""

from megatron_longstraw.testing.hf_reference import hf_model_class

for _model_type in ("qwen3_5_text", "qwen3_5_moe_text", "glm_moe_dsa"):
    hf_model_class(_model_type)
