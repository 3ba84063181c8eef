"""The chip side: one actor per TPU chip, the slice they form, and each host's sidecar.

Never imports the client, the controller or the service."""
