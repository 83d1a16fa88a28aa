"""Data-parallel serving: a router in front of radixlm (or SGLang) replicas that keeps prefix hits high."""
