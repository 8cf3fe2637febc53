"""The wire between ranks: every collective (collectives.py) and the stores ranks meet in."""
