"""What-if planning: run the pure engine in virtual time against a scenario."""
