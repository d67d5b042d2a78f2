# A GPU site on Azure: its own resource group and virtual network, one VM per engine with a
# static public address that only the gateway's egress addresses may reach (gRPC port only; no
# SSH rule), a server certificate per engine, and a Key Vault holding one secret bundle per engine
# that only the site's managed identity may read.

locals {
  instances = { for index, name in var.instance_names : name => index }
  base      = "${var.name_prefix}-${var.name}"
  # Key Vault names are global, 3-24 characters: a random suffix also lets a vault be re-created
  # while its soft-deleted predecessor still holds the old name.
  vault_name  = "${substr(replace(local.base, "-", ""), 0, 14)}kv${random_id.vault.hex}"
  vault_rules = [for cidr in var.operator_cidrs : trimsuffix(cidr, "/32")]
}

data "azurerm_client_config" "current" {}

resource "azurerm_resource_group" "site" {
  name     = local.base
  location = var.location
  tags     = var.tags
}

resource "azurerm_virtual_network" "site" {
  name                = local.base
  location            = var.location
  resource_group_name = azurerm_resource_group.site.name
  address_space       = [var.vpc_cidr]
  tags                = var.tags
}

resource "azurerm_subnet" "engines" {
  name                 = "engines"
  resource_group_name  = azurerm_resource_group.site.name
  virtual_network_name = azurerm_virtual_network.site.name
  address_prefixes     = [cidrsubnet(var.vpc_cidr, 4, 0)]
  # The vault admits this subnet through its service endpoint.
  service_endpoints = ["Microsoft.KeyVault"]
}

resource "azurerm_network_security_group" "engines" {
  name                = "${local.base}-engines"
  location            = var.location
  resource_group_name = azurerm_resource_group.site.name
  tags                = var.tags
}

resource "azurerm_network_security_rule" "grpc_from_gateway" {
  name                        = "grpc-from-gateway"
  resource_group_name         = azurerm_resource_group.site.name
  network_security_group_name = azurerm_network_security_group.engines.name
  priority                    = 100
  direction                   = "Inbound"
  access                      = "Allow"
  protocol                    = "Tcp"
  source_port_range           = "*"
  destination_port_range      = tostring(var.grpc_port)
  source_address_prefixes     = var.gateway_cidrs
  destination_address_prefix  = "VirtualNetwork"
}

# Outbound: HTTPS (registry, Hugging Face, Key Vault) and HTTP (Ubuntu mirrors) only. The instance
# metadata service and Azure DNS are not subject to security rules.
resource "azurerm_network_security_rule" "egress_web" {
  name                        = "egress-web"
  resource_group_name         = azurerm_resource_group.site.name
  network_security_group_name = azurerm_network_security_group.engines.name
  priority                    = 100
  direction                   = "Outbound"
  access                      = "Allow"
  protocol                    = "Tcp"
  source_port_range           = "*"
  destination_port_ranges     = ["80", "443"]
  source_address_prefix       = "VirtualNetwork"
  destination_address_prefix  = "Internet"
}

resource "azurerm_network_security_rule" "egress_deny" {
  name                        = "egress-deny-internet"
  resource_group_name         = azurerm_resource_group.site.name
  network_security_group_name = azurerm_network_security_group.engines.name
  priority                    = 4000
  direction                   = "Outbound"
  access                      = "Deny"
  protocol                    = "*"
  source_port_range           = "*"
  destination_port_range      = "*"
  source_address_prefix       = "VirtualNetwork"
  destination_address_prefix  = "Internet"
}

resource "azurerm_subnet_network_security_group_association" "engines" {
  subnet_id                 = azurerm_subnet.engines.id
  network_security_group_id = azurerm_network_security_group.engines.id
}

resource "azurerm_user_assigned_identity" "engines" {
  name                = "${local.base}-engines"
  location            = var.location
  resource_group_name = azurerm_resource_group.site.name
  tags                = var.tags
}

resource "random_id" "vault" {
  byte_length = 4
}

resource "azurerm_key_vault" "site" {
  #checkov:skip=CKV_AZURE_189:Public network access stays on because the network ACL below denies by default and admits only the engines' subnet (service endpoint) and the operators' addresses, from where Terraform writes the bundles; a private endpoint would need Terraform to run inside the virtual network.
  #checkov:skip=CKV2_AZURE_32:Same reason as CKV_AZURE_189: access is restricted by the deny-by-default network ACL, not by a private endpoint.
  name                       = local.vault_name
  location                   = var.location
  resource_group_name        = azurerm_resource_group.site.name
  tenant_id                  = data.azurerm_client_config.current.tenant_id
  sku_name                   = "standard"
  purge_protection_enabled   = true
  soft_delete_retention_days = 7
  network_acls {
    bypass                     = "AzureServices"
    default_action             = "Deny"
    ip_rules                   = local.vault_rules
    virtual_network_subnet_ids = [azurerm_subnet.engines.id]
  }
  # Whoever runs Terraform writes the bundles; the engines' identity only reads them.
  access_policy {
    tenant_id          = data.azurerm_client_config.current.tenant_id
    object_id          = data.azurerm_client_config.current.object_id
    secret_permissions = ["Get", "List", "Set", "Delete", "Recover", "Purge"]
  }
  access_policy {
    tenant_id          = data.azurerm_client_config.current.tenant_id
    object_id          = azurerm_user_assigned_identity.engines.principal_id
    secret_permissions = ["Get"]
  }
  tags = var.tags
}

resource "azurerm_public_ip" "engine" {
  for_each            = local.instances
  name                = "${var.name_prefix}-${each.key}"
  location            = var.location
  resource_group_name = azurerm_resource_group.site.name
  allocation_method   = "Static"
  sku                 = "Standard"
  zones               = var.zone == null ? null : [var.zone]
  tags                = var.tags
}

resource "azurerm_network_interface" "engine" {
  #checkov:skip=CKV_AZURE_119:The gateway reaches sites in every cloud over the internet; the security group admits only the gateway's NAT addresses on the gRPC port, and the traffic is mutually authenticated TLS.
  for_each            = local.instances
  name                = "${var.name_prefix}-${each.key}"
  location            = var.location
  resource_group_name = azurerm_resource_group.site.name
  tags                = var.tags
  ip_configuration {
    name                          = "primary"
    subnet_id                     = azurerm_subnet.engines.id
    private_ip_address_allocation = "Dynamic"
    public_ip_address_id          = azurerm_public_ip.engine[each.key].id
  }
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
  ip_addresses    = [azurerm_public_ip.engine[each.key].ip_address]
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

resource "azurerm_key_vault_secret" "bundle" {
  for_each     = local.instances
  name         = "${each.key}-bundle"
  key_vault_id = azurerm_key_vault.site.id
  content_type = "application/json"
  # The bundle is worthless once its certificate has expired; re-issue renews both.
  expiration_date = tls_locally_signed_cert.engine[each.key].validity_end_time
  value = jsonencode({
    ca_pem   = var.tls_ca_cert_pem
    cert_pem = tls_locally_signed_cert.engine[each.key].cert_pem
    key_pem  = tls_private_key.engine[each.key].private_key_pem
    hf_token = var.hf_token
  })
}

# Only used to satisfy Azure's requirement of a key on Linux VMs: no security rule admits SSH.
resource "tls_private_key" "admin" {
  algorithm = "ED25519"
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
    token="$(curl -fsS -H Metadata:true 'http://169.254.169.254/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fvault.azure.net&client_id=${azurerm_user_assigned_identity.engines.client_id}' | python3 -c 'import json, sys; print(json.load(sys.stdin)["access_token"])')"
    curl -fsS -H "Authorization: Bearer $token" '${azurerm_key_vault.site.vault_uri}secrets/${each.key}-bundle?api-version=7.4' | python3 -c 'import json, sys; sys.stdout.write(json.load(sys.stdin)["value"])'
  EOT
}

resource "azurerm_linux_virtual_machine" "engine" {
  for_each                        = local.instances
  name                            = "${var.name_prefix}-${each.key}"
  location                        = var.location
  resource_group_name             = azurerm_resource_group.site.name
  size                            = var.vm_size
  zone                            = var.zone
  admin_username                  = "fedllm"
  disable_password_authentication = true
  allow_extension_operations      = false
  network_interface_ids           = [azurerm_network_interface.engine[each.key].id]
  custom_data                     = base64encode(module.boot[each.key].script)
  admin_ssh_key {
    username   = "fedllm"
    public_key = tls_private_key.admin.public_key_openssh
  }
  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "Premium_LRS"
    disk_size_gb         = var.disk_gb
  }
  source_image_reference {
    publisher = var.source_image.publisher
    offer     = var.source_image.offer
    sku       = var.source_image.sku
    version   = var.source_image.version
  }
  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.engines.id]
  }
  tags = merge(var.tags, { "fedllm-site" = var.name })
}
