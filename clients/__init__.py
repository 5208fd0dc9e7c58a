"""Clients of the systems the service talks to. Each call returns a `Result`; none raises."""
