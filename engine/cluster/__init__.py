"""Scale-out on Ray: one actor per model replica (`worker`), and the control-process side that applies
the serving policy's plans to those actors (`controller`): admission, re-homing with real state
migration through the Ray object store, offload to host memory, and failure recovery.

Ray is an optional dependency (the ``cluster`` extra); nothing outside this package imports it, and the
single-machine server stays in-process without it.
"""
