"""Pipeline schedules as tables both frameworks run, and the automatic choice between them."""
