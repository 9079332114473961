"""What starts a job's actor processes: this runner on its own machine, or a cluster manager
(``base.py`` holds the seam and the table; one file per launcher)."""
