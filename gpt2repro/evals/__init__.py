"""What the evaluations share: scoring continuations of a prompt through the KV cache (HellaSwag, CORE), and CORE's task bundle read as untrusted data."""
