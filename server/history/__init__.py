"""The history database: its schema and writer, read queries, exports, the HTML report and
`compare()`'s results."""
