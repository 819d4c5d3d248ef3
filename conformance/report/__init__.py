"""What a run leaves behind: the certificate, its summary and merge, the report directory,
progress output and the acceptance chart."""
