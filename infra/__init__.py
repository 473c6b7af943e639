"""Engineering that lets the method scale and survive: skip this folder on a first read.

scale (torchrun, FSDP2), run (settings checks, model loading, logs, the run's bookkeeping), checkpoint
(atomic checkpoints, resume, graceful stop), hf (Hugging Face LLaDA checkpoint I/O), lora (adapters),
fast_sample (KV-cache and threshold rollouts), sandbox (running generated code), scorer (remote image
rewards), data (benchmark readers), budget (the dry-run memory and FLOPs), diagnose (estimators against
the exact log-ratio), plots (PNG curves) and bench (speed tables).
"""
