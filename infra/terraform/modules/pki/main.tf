# The federation's private CA for mutual TLS between the gateway and its sites, and the gateway's
# client certificate. Each site module issues its own server certificate from this CA, naming the
# site's fixed public address. Private keys live in Terraform state: keep the state in an
# encrypted backend with restricted access (docs/deploy.md).

resource "tls_private_key" "ca" {
  algorithm   = "ECDSA"
  ecdsa_curve = "P256"
}

resource "tls_self_signed_cert" "ca" {
  private_key_pem       = tls_private_key.ca.private_key_pem
  is_ca_certificate     = true
  validity_period_hours = var.ca_validity_days * 24
  allowed_uses          = ["cert_signing", "crl_signing"]
  subject {
    common_name  = "${var.name_prefix} federation CA"
    organization = var.name_prefix
  }
}

resource "tls_private_key" "gateway" {
  algorithm   = "ECDSA"
  ecdsa_curve = "P256"
}

resource "tls_cert_request" "gateway" {
  private_key_pem = tls_private_key.gateway.private_key_pem
  subject {
    common_name  = "${var.name_prefix}-gateway"
    organization = var.name_prefix
  }
}

resource "tls_locally_signed_cert" "gateway" {
  cert_request_pem      = tls_cert_request.gateway.cert_request_pem
  ca_private_key_pem    = tls_private_key.ca.private_key_pem
  ca_cert_pem           = tls_self_signed_cert.ca.cert_pem
  validity_period_hours = var.leaf_validity_days * 24
  early_renewal_hours   = 30 * 24
  allowed_uses          = ["digital_signature", "key_agreement", "client_auth"]
}
