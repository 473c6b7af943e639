"""Engineering that lets the method scale and survive: skip this folder on a first read.

scale (torchrun, FSDP2), settings (every setting checked once), load (the policy, its reference, the toy SFT
cache), run (start-up checks, logs, the run's bookkeeping), checkpoint (atomic checkpoints, resume, graceful stop), hf (Hugging Face LLaDA checkpoint
I/O), LoRA adapters), sandbox (running generated code), scorer (remote image
rewards), data (benchmark readers), budget (the dry-run memory and FLOPs), diagnose (estimators against
the exact log-ratio), plots (PNG curves) and bench (speed tables).
"""
