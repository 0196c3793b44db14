"""The report: summary.json from a finished plan, read back as typed records, the answers (claims) and findings, rendering and plots."""
