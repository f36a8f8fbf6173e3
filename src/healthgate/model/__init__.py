"""Resource schemas, names and references, validation and manifests."""
