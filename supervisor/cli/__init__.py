"""What users and operators touch: the `rlsup` commands, the Prometheus endpoint, systemd readiness.

The top layer: it may import every other package of supervisor; nothing imports it."""
