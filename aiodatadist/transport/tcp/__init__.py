"""transport.tcp"""
