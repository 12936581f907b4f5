"""The pipeline over `pp`: GPipe on GSPMD, the hand-scheduled executor, its tick plan and gradients, the auto choice."""
