# What the gateway is told about the federation: the federation file of gateway/federation.py,
# rendered from the site map and the sites' fixed addresses. tests/infra evaluates these very
# expressions against example.tfvars and starts a gateway with the result.

locals {
  # One engine per instance: a site with count 1 keeps its name, otherwise <site>-1 ... <site>-N.
  instance_names = {
    for name, site in var.sites : name => (
      site.count == 1 ? [name] : [for i in range(site.count) : "${name}-${i + 1}"]
    )
  }

  site_endpoints = merge(
    { for name, site in module.aws_site : name => site.endpoints },
    { for name, site in module.gcp_site : name => site.endpoints },
    { for name, site in module.azure_site : name => site.endpoints },
  )

  # The name each engine's certificate carries (its federation name), from the site modules: the
  # gateway dials an address and checks the certificate for this name (tls_server_name).
  site_tls_server_names = merge(
    { for name, site in module.aws_site : name => site.tls_server_names },
    { for name, site in module.gcp_site : name => site.tls_server_names },
    { for name, site in module.azure_site : name => site.tls_server_names },
  )

  site_public_ips = merge(
    { for name, site in module.aws_site : name => site.public_ips },
    { for name, site in module.gcp_site : name => site.public_ips },
    { for name, site in module.azure_site : name => site.public_ips },
  )

  # Draining sites keep running but leave the gateway's federation.
  serving_sites = sort([for name, site in var.sites : name if !site.drain])

  # Only models some serving site serves: the gateway lists (and loads a tokenizer for) each.
  served_models = {
    for name, model in var.models : name => model
    if contains(concat(
      [for site in local.serving_sites : var.sites[site].model],
      [for site in values(var.openai_sites) : site.model],
    ), name)
  }

  # Engines already running elsewhere (vLLM, SGLang): sites of kind openai, no instance here.
  # Optional fields left null are dropped, so the gateway applies its own defaults.
  openai_federation_sites = [
    for name in sort(keys(var.openai_sites)) : {
      for key, value in merge(var.openai_sites[name], {
        name         = name
        kind         = "openai"
        engine_model = coalesce(var.openai_sites[name].engine_model, var.openai_sites[name].model)
      }) : key => value if value != null
    }
  ]

  federation = {
    # Tokenizer paths are relative to the federation file; docker/gateway-entrypoint.sh downloads
    # each served model's tokenizer there (FEDLLM_MODELS).
    models = [for name in sort(keys(local.served_models)) : { name = name, tokenizer = "models/${name}" }]
    sites = concat(flatten([
      for name in local.serving_sites : [
        for index, instance in local.instance_names[name] : {
          name            = instance
          cloud           = var.sites[name].cloud
          region          = var.sites[name].region
          endpoint        = local.site_endpoints[name][index]
          model           = var.sites[name].model
          capacity_weight = var.sites[name].capacity_weight
          tls_server_name = local.site_tls_server_names[name][index]
        }
      ]
    ]), local.openai_federation_sites)
  }

  gateway_environment = merge(
    var.gateway.settings,
    {
      GATEWAY_ROUTING_POLICY = var.gateway.routing_policy
      FEDLLM_FEDERATION_JSON = jsonencode(local.federation)
      FEDLLM_MODELS          = jsonencode(local.served_models)
    },
    var.gateway.predictor_dir == null ? {} : { GATEWAY_PREDICTOR_DIR = var.gateway.predictor_dir },
  )
}
