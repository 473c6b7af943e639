"""Engineering that lets the method scale and survive: skip this folder on a first read.

scale (torchrun, FSDP2), fast_sample (Fast-dLLM's KV cache and threshold for rollouts), settings (every
setting checked once), load (the policy, its reference, the toy SFT cache), run (start-up checks, logs, the run's
bookkeeping), checkpoint (atomic checkpoints, resume, graceful stop), hf (Hugging Face LLaDA checkpoint
I/O), lora (adapters, the adapters-off reference), sandbox (running generated code), scorer (remote image
rewards), data (benchmark readers), budget (the dry-run memory and FLOPs), diagnose (estimators against
the exact log-ratio), plots (PNG curves) and bench (speed tables).
"""
