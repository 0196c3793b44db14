"""Shipped calibration sets (project-written JSON); a package so wheels include the files."""
