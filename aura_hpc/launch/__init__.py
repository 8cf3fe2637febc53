"""Starting workers without Slurm: `local` on one machine or on LAN machines (torch's elastic agent),
and the run-directory set-up that `local` and `submit` share before any worker starts."""
