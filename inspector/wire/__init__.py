"""What crosses to the server and the page, with no torch: records (snapshots, events, hook specs),
the hook kinds' table and parameter schemas, and the errors."""
