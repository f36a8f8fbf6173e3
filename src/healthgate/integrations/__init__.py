"""What other data planes read of healthgate's decisions (SPEC §5): a
forwarding rule's health as a status code, HAProxy's agent-check answers and
configuration. Each answer is derived from the engine's states; the
decisions themselves are made once, in health/."""
