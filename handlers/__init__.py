"""HTTP handlers: authentication, parsing and answers. Event logic lives in plugins/."""
