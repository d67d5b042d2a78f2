# A GPU site on GCP: its own VPC network, one instance per engine with a fixed external address
# that only the gateway's egress addresses may reach (gRPC port only; no SSH rule), a server
# certificate per engine, and a secret bundle per engine readable only by the site's service
# account.

locals {
  instances   = { for index, name in var.instance_names : name => index }
  base        = "${var.name_prefix}-${var.name}"
  network_tag = "${local.base}-engine"
}

resource "google_compute_network" "site" {
  project                 = var.project
  name                    = local.base
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"
}

resource "google_compute_subnetwork" "site" {
  project                  = var.project
  name                     = local.base
  region                   = var.region
  network                  = google_compute_network.site.id
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true
  log_config {
    aggregation_interval = "INTERVAL_5_SEC"
    flow_sampling        = 1.0
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

resource "google_compute_firewall" "grpc_from_gateway" {
  project       = var.project
  name          = "${local.base}-grpc-from-gateway"
  network       = google_compute_network.site.id
  direction     = "INGRESS"
  priority      = 1000
  source_ranges = var.gateway_cidrs
  target_tags   = [local.network_tag]
  allow {
    protocol = "tcp"
    ports    = [tostring(var.grpc_port)]
  }
  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}

# Outbound: HTTPS (registry, Hugging Face, Google APIs) and HTTP (Ubuntu mirrors) only. The
# metadata server, which also answers DNS, is never subject to firewall rules.
resource "google_compute_firewall" "egress_web" {
  project            = var.project
  name               = "${local.base}-egress-web"
  network            = google_compute_network.site.id
  direction          = "EGRESS"
  priority           = 1000
  destination_ranges = ["0.0.0.0/0"]
  target_tags        = [local.network_tag]
  allow {
    protocol = "tcp"
    ports    = ["80", "443"]
  }
}

resource "google_compute_firewall" "egress_deny" {
  project            = var.project
  name               = "${local.base}-egress-deny"
  network            = google_compute_network.site.id
  direction          = "EGRESS"
  priority           = 65000
  destination_ranges = ["0.0.0.0/0"]
  target_tags        = [local.network_tag]
  deny {
    protocol = "all"
  }
}

resource "google_service_account" "engine" {
  project      = var.project
  account_id   = "${substr(local.base, 0, 21)}-${substr(sha1(local.base), 0, 8)}"
  display_name = "fedllm site ${var.name}"
}

resource "google_compute_address" "engine" {
  for_each     = local.instances
  project      = var.project
  region       = var.region
  name         = "${var.name_prefix}-${each.key}"
  address_type = "EXTERNAL"
  network_tier = "PREMIUM"
}

resource "tls_private_key" "engine" {
  for_each    = local.instances
  algorithm   = "ECDSA"
  ecdsa_curve = "P256"
}

resource "tls_cert_request" "engine" {
  for_each        = local.instances
  private_key_pem = tls_private_key.engine[each.key].private_key_pem
  dns_names       = [each.key]
  ip_addresses    = [google_compute_address.engine[each.key].address]
  subject {
    common_name  = each.key
    organization = var.name_prefix
  }
}

# client_auth as well as server_auth: the container's health probe (site_engine/healthcheck.py)
# presents the engine's own certificate to the engine, whose client CA is this same CA.
resource "tls_locally_signed_cert" "engine" {
  for_each              = local.instances
  cert_request_pem      = tls_cert_request.engine[each.key].cert_request_pem
  ca_private_key_pem    = var.tls_ca_private_key_pem
  ca_cert_pem           = var.tls_ca_cert_pem
  validity_period_hours = var.tls_validity_days * 24
  early_renewal_hours   = 30 * 24
  allowed_uses          = ["digital_signature", "key_agreement", "server_auth", "client_auth"]
}

resource "google_secret_manager_secret" "bundle" {
  for_each  = local.instances
  project   = var.project
  secret_id = "${var.name_prefix}-${each.key}-bundle"
  labels    = var.labels
  replication {
    user_managed {
      replicas {
        location = var.region
      }
    }
  }
}

resource "google_secret_manager_secret_version" "bundle" {
  for_each = local.instances
  secret   = google_secret_manager_secret.bundle[each.key].id
  secret_data = jsonencode({
    ca_pem   = var.tls_ca_cert_pem
    cert_pem = tls_locally_signed_cert.engine[each.key].cert_pem
    key_pem  = tls_private_key.engine[each.key].private_key_pem
    hf_token = var.hf_token
  })
}

resource "google_secret_manager_secret_iam_member" "engine_reads_bundle" {
  for_each  = local.instances
  project   = var.project
  secret_id = google_secret_manager_secret.bundle[each.key].secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.engine.email}"
}

module "boot" {
  source        = "../site_boot"
  for_each      = local.instances
  instance_name = each.key
  model         = var.model
  image         = var.image
  grpc_port     = var.grpc_port
  settings      = var.settings
  fetch_bundle  = <<-EOT
    token="$(curl -fsS -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token | python3 -c 'import json, sys; print(json.load(sys.stdin)["access_token"])')"
    curl -fsS -H "Authorization: Bearer $token" https://secretmanager.googleapis.com/v1/projects/${var.project}/secrets/${google_secret_manager_secret.bundle[each.key].secret_id}/versions/latest:access | python3 -c 'import base64, json, sys; sys.stdout.write(base64.b64decode(json.load(sys.stdin)["payload"]["data"]).decode())'
  EOT
}

resource "google_compute_instance" "engine" {
  #checkov:skip=CKV_GCP_40:The gateway reaches sites in every cloud over the internet; the firewall admits only the gateway's NAT addresses on the gRPC port, and the traffic is mutually authenticated TLS.
  #checkov:skip=CKV_GCP_38:Customer-supplied disk keys must be handed to GCP at every start, which an unattended GPU fleet cannot do; the disk is encrypted with Google-managed keys and holds only public weights and the container image.
  for_each                  = local.instances
  project                   = var.project
  zone                      = var.zone
  name                      = "${var.name_prefix}-${each.key}"
  machine_type              = var.machine_type
  tags                      = [local.network_tag]
  labels                    = merge(var.labels, { fedllm-site = var.name })
  allow_stopping_for_update = true
  boot_disk {
    initialize_params {
      image = var.boot_image
      size  = var.disk_gb
      type  = var.boot_disk_type
    }
  }
  network_interface {
    subnetwork = google_compute_subnetwork.site.id
    access_config {
      nat_ip       = google_compute_address.engine[each.key].address
      network_tier = "PREMIUM"
    }
  }
  service_account {
    email  = google_service_account.engine.email
    scopes = ["cloud-platform"]
  }
  # GPUs cannot live-migrate.
  scheduling {
    on_host_maintenance = "TERMINATE"
    automatic_restart   = true
  }
  shielded_instance_config {
    # The NVIDIA kernel modules the GPU images build at first boot are not signed for Secure Boot.
    enable_secure_boot          = false
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }
  metadata = {
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    serial-port-enable     = "false"
    install-nvidia-driver  = "True"
  }
  # Changing the script (new image, settings) replaces the instance, as on the other clouds.
  metadata_startup_script = module.boot[each.key].script
}
