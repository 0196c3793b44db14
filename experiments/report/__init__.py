"""The report: summary.json from a finished plan, read back as typed records, verdicts, claims, rendering and plots."""
