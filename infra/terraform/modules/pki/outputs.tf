output "ca_cert_pem" {
  description = "The CA certificate: both ends trust only certificates it signed."
  value       = tls_self_signed_cert.ca.cert_pem
}

output "ca_private_key_pem" {
  description = "The CA's private key, for the site modules to sign their server certificates."
  value       = tls_private_key.ca.private_key_pem
  sensitive   = true
}

output "gateway_cert_pem" {
  description = "The gateway's client certificate."
  value       = tls_locally_signed_cert.gateway.cert_pem
}

output "gateway_private_key_pem" {
  description = "The gateway's client private key."
  value       = tls_private_key.gateway.private_key_pem
  sensitive   = true
}
