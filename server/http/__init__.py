"""HTTP plumbing shared by every protocol: errors, API keys, body limits, strict JSON, the gate."""
