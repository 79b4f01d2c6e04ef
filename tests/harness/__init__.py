"""Test harness: brokers, fleets, network namespaces and fakes shared by the tests."""
