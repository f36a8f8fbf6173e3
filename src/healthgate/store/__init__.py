"""The store: revisioned documents, engine states and the transition log."""
