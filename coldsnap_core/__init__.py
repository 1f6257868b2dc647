"""coldsnap_core: the artifact format, the canonical writers, the verifier and hydration. Imports neither vllm nor sglang."""
