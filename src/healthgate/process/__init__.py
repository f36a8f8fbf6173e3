"""Process plumbing shared by every kind of worker process: the file limit,
typed messages over pipes, and one supervisor (restart with backoff, stop
in order, a worker that stops reading)."""
