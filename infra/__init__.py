"""Engineering that lets the method scale and survive: skip this folder on a first read.

scale (torchrun, FSDP2, the dry-run budget), checkpoint (atomic checkpoints, resume, graceful stop), lora
(adapters), sandbox (running generated code), scorer (remote image rewards), data (benchmark readers),
episodes (tasks -> token batches, held-out evaluation), plots (PNG curves) and bench (speed tables).
"""
