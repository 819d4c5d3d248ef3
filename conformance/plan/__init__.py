"""What a run is asked to do, at the bottom of the suite's layers: the specs, prompt sets,
profiles, request builders and drawn shapes, and the errors a command reports. checks/, run/,
report/ and repro/ import it; it imports none of them."""
