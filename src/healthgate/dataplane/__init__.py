"""The data plane: listeners for forwarding rules, routed by the engine's live decisions."""
