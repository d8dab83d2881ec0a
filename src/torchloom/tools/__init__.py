"""Looking at a schedule: verification, static checks and testing helpers."""
