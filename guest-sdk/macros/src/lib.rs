//! Attribute macros of the wasmrpc guest SDK. Use them through
//! `wasmrpc_guest`, never directly: the generated code reaches its
//! dependencies only through `wasmrpc_guest::__private`.
//!
//! - `#[remote]` / `#[remote(async_execution)]` on a free function.
//! - `#[remote_class]` on an inherent `impl` block, with `#[constructor]`,
//!   `#[async_execution]` and `#[skip]` on its functions.
//! - `permissions!(ops = [...], calls = [...])` once per plugin: what it
//!   asks a worker to let it do beyond a deployed plugin's defaults.
//!
//! Each export becomes a C-ABI wrapper `(object: u32, len: u32) -> u64`
//! named by `wasmrpc_abi::protocol::export_name`, plus framed manifest
//! records in the `wasmrpc-manifest` custom section. Misuse is reported with
//! spanned errors.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    FnArg, Ident, ImplItem, ImplItemFn, ItemFn, ItemImpl, Pat, ReturnType, Signature, Type,
    parse_macro_input,
};
use wasmrpc_abi::manifest::{Export, Permissions, Record};
use wasmrpc_abi::protocol::{
    ABI_VERSION, ExportKind, MANIFEST_SECTION, drop_export_name, export_name,
};

/// Exports a free function so that workers can call it by name.
///
/// Parameters must be plain identifiers of types implementing `FromValue`;
/// their names are the keyword-argument names. The function returns a type
/// implementing `IntoValue`, or a `Result` of one whose error converts into
/// `wasmrpc_guest::Error`. With `#[remote(async_execution)]` it returns a
/// `wasmrpc_guest::Future` (or a `Result` of one) and the call completes
/// when that future does; a `wasmrpc_guest::MaybeFuture` defers the check
/// to run time, as Python does.
#[proc_macro_attribute]
pub fn remote(attr: TokenStream, item: TokenStream) -> TokenStream {
    let attr = TokenStream2::from(attr);
    let item_fn = parse_macro_input!(item as ItemFn);
    match expand_remote(attr, &item_fn) {
        Ok(tokens) => tokens.into(),
        Err(e) => {
            let e = e.to_compile_error();
            quote!(#item_fn #e).into()
        }
    }
}

/// Declares what the plugin asks a worker to let it do beyond a deployed
/// plugin's defaults (the worker's op families; its own functions and
/// builtin ops as RPC targets): `ops` patterns (`"aten::from_file"`,
/// `"aten::linalg_*"`, `"@random"`) and `calls` to other plugins' functions
/// (`"hello::*"`, `"seed_fns::identity"`). Either list may be left out.
/// A worker grants at most what its operator's op policy allows; plugins
/// its operator loads itself get the worker's whole policy anyway.
///
/// ```ignore
/// wasmrpc_guest::permissions!(ops = ["aten::from_file"], calls = ["hello::*"]);
/// ```
#[proc_macro]
pub fn permissions(input: TokenStream) -> TokenStream {
    match expand_permissions(input.into()) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand_permissions(input: TokenStream2) -> syn::Result<TokenStream2> {
    use syn::punctuated::Punctuated;
    let span = input.span();
    let entries = syn::parse::Parser::parse2(
        Punctuated::<syn::MetaNameValue, syn::Token![,]>::parse_terminated,
        input,
    )?;
    let mut permissions = Permissions::default();
    let mut seen = Vec::new();
    for entry in entries {
        let key = entry.path.get_ident().map(ToString::to_string);
        let list = match key.as_deref() {
            Some("ops") => &mut permissions.ops,
            Some("calls") => &mut permissions.calls,
            _ => {
                return Err(syn::Error::new_spanned(
                    &entry.path,
                    "expected `ops = [...]` or `calls = [...]`",
                ));
            }
        };
        if seen.contains(&key) {
            return Err(syn::Error::new_spanned(&entry.path, "given twice"));
        }
        seen.push(key);
        let syn::Expr::Array(array) = &entry.value else {
            return Err(syn::Error::new_spanned(
                &entry.value,
                "expected a list of string literals: [\"aten::from_file\"]",
            ));
        };
        for item in &array.elems {
            match item {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(text),
                    ..
                }) if !text.value().trim().is_empty()
                    && !text.value().contains(char::is_whitespace) =>
                {
                    list.push(text.value());
                }
                other => {
                    return Err(syn::Error::new_spanned(
                        other,
                        "expected a pattern as a string literal without spaces",
                    ));
                }
            }
        }
    }
    let manifest = manifest_static(&[plugin_record(), Record::Permissions(permissions)], span)?;
    Ok(quote! {
        #[doc(hidden)]
        const _: () = {
            #manifest
        };
    })
}

/// Exports a class: an inherent `impl` block with one `#[constructor]`
/// function, methods taking `&self` or `&mut self`, and functions without
/// `self`, exported as `Class.name`.
///
/// Mark `@async_execution` methods and functions with `#[async_execution]`
/// and helpers that must not be exported with `#[skip]`.
#[proc_macro_attribute]
pub fn remote_class(attr: TokenStream, item: TokenStream) -> TokenStream {
    let attr = TokenStream2::from(attr);
    let mut item_impl = parse_macro_input!(item as ItemImpl);
    match expand_class(attr, &mut item_impl) {
        Ok(tokens) => tokens.into(),
        Err(e) => {
            strip_inert(&mut item_impl);
            let e = e.to_compile_error();
            quote!(#item_impl #e).into()
        }
    }
}

/// A parameter: its keyword name, the binding and its type.
struct Param {
    name: String,
    ident: Ident,
    ty: Type,
}

fn parse_async_flag(attr: TokenStream2) -> syn::Result<bool> {
    if attr.is_empty() {
        return Ok(false);
    }
    let ident: Ident = syn::parse2(attr.clone())
        .map_err(|_| syn::Error::new_spanned(&attr, "expected `async_execution` or nothing"))?;
    if ident == "async_execution" {
        Ok(true)
    } else {
        Err(syn::Error::new_spanned(
            ident,
            "unknown argument: expected `async_execution`",
        ))
    }
}

/// Checks a signature and collects its parameters (without the receiver).
fn check_signature(sig: &Signature, what: &str) -> syn::Result<Vec<Param>> {
    if let Some(a) = &sig.asyncness {
        return Err(syn::Error::new_spanned(
            a,
            format!(
                "{what} cannot be `async fn`: guests have no executor; use \
                 `async_execution` and return a `wasmrpc_guest::Future`"
            ),
        ));
    }
    if let Some(u) = &sig.unsafety {
        return Err(syn::Error::new_spanned(
            u,
            format!("{what} cannot be `unsafe`"),
        ));
    }
    if let Some(abi) = &sig.abi {
        return Err(syn::Error::new_spanned(
            abi,
            format!("{what} cannot declare an ABI"),
        ));
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        return Err(syn::Error::new_spanned(
            &sig.generics,
            format!("{what} cannot be generic: the host calls it with dynamic values"),
        ));
    }
    if let Some(v) = &sig.variadic {
        return Err(syn::Error::new_spanned(
            v,
            format!("{what} cannot be variadic"),
        ));
    }
    let mut params = Vec::new();
    for input in &sig.inputs {
        let FnArg::Typed(pt) = input else { continue };
        let Pat::Ident(pi) = &*pt.pat else {
            return Err(syn::Error::new_spanned(
                &pt.pat,
                "parameters must be plain identifiers: their names are the keyword-argument names",
            ));
        };
        if pi.by_ref.is_some() || pi.subpat.is_some() {
            return Err(syn::Error::new_spanned(
                &pt.pat,
                "parameters must be plain identifiers",
            ));
        }
        if let Type::ImplTrait(_) | Type::Reference(_) = &*pt.ty {
            return Err(syn::Error::new_spanned(
                &pt.ty,
                "parameters must be owned types implementing `FromValue`",
            ));
        }
        let name = pi.ident.to_string();
        let name = name.strip_prefix("r#").unwrap_or(&name).to_owned();
        params.push(Param {
            name,
            ident: format_ident!("__wasmrpc_arg_{}", params.len()),
            ty: (*pt.ty).clone(),
        });
    }
    Ok(params)
}

fn manifest_static(records: &[Record], span: Span) -> syn::Result<TokenStream2> {
    let mut bytes = Vec::new();
    for r in records {
        bytes.extend(
            r.frame()
                .map_err(|e| syn::Error::new(span, format!("cannot encode the manifest: {e}")))?,
        );
    }
    let len = bytes.len();
    Ok(quote! {
        #[cfg(target_arch = "wasm32")]
        #[unsafe(link_section = #MANIFEST_SECTION)]
        #[used]
        static __WASMRPC_MANIFEST: [u8; #len] = [#(#bytes),*];
    })
}

fn plugin_record() -> Record {
    Record::Plugin {
        name: std::env::var("CARGO_PKG_NAME").unwrap_or_else(|_| "unknown".to_owned()),
        version: std::env::var("CARGO_PKG_VERSION").unwrap_or_else(|_| "0.0.0".to_owned()),
        abi: ABI_VERSION,
    }
}

/// The statements that convert the arguments, then `call`.
fn bind_args(params: &[Param]) -> TokenStream2 {
    let binds = params.iter().enumerate().map(|(i, p)| {
        let (ident, ty) = (&p.ident, &p.ty);
        quote_spanned! {ty.span()=>
            let #ident: #ty = __wasmrpc_args.take::<#ty>(#i)?;
        }
    });
    quote!(#(#binds)*)
}

fn outcome(ret: &ReturnType, is_async: bool, call: TokenStream2) -> TokenStream2 {
    let span = match ret {
        ReturnType::Default => Span::call_site(),
        ReturnType::Type(_, ty) => ty.span(),
    };
    if is_async {
        quote_spanned! {span=>
            ::wasmrpc_guest::__private::IntoAsyncOutcome::into_async_outcome(#call)
        }
    } else {
        quote_spanned! {span=>
            ::wasmrpc_guest::__private::IntoOutcome::into_outcome(#call)
        }
    }
}

fn expand_remote(attr: TokenStream2, item: &ItemFn) -> syn::Result<TokenStream2> {
    let is_async = parse_async_flag(attr)?;
    let params = check_signature(&item.sig, "a #[remote] function")?;
    if let Some(FnArg::Receiver(r)) = item.sig.inputs.first() {
        return Err(syn::Error::new_spanned(
            r,
            "a #[remote] function takes no `self`: put methods in a #[remote_class] impl",
        ));
    }
    let fn_ident = &item.sig.ident;
    let name = fn_ident.to_string();
    let kind = if is_async {
        ExportKind::AsyncFunction
    } else {
        ExportKind::Function
    };
    let export = export_name(kind, None, &name);
    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    let idents: Vec<&Ident> = params.iter().map(|p| &p.ident).collect();
    let binds = bind_args(&params);
    let outcome = outcome(&item.sig.output, is_async, quote!(#fn_ident(#(#idents),*)));
    let manifest = manifest_static(
        &[
            plugin_record(),
            Record::Export(Export {
                name: name.clone(),
                kind,
                class: None,
                params: names.iter().map(|s| (*s).to_owned()).collect(),
            }),
        ],
        fn_ident.span(),
    )?;
    Ok(quote! {
        #item
        #[doc(hidden)]
        const _: () = {
            #[unsafe(export_name = #export)]
            extern "C" fn __wasmrpc_export(_object: u32, len: u32) -> u64 {
                ::wasmrpc_guest::__private::run(#name, &[#(#names),*], len, |__wasmrpc_args| {
                    #binds
                    ::core::result::Result::Ok(#outcome)
                })
            }
            #manifest
        };
    })
}

/// What a function of a class impl is.
enum Role {
    Constructor,
    Method,
    Static,
}

fn take_flag(f: &mut ImplItemFn, name: &str) -> Option<Span> {
    let i = f.attrs.iter().position(|a| a.path().is_ident(name))?;
    let attr = f.attrs.remove(i);
    Some(attr.meta.span())
}

fn strip_inert(item: &mut ItemImpl) {
    for it in &mut item.items {
        if let ImplItem::Fn(f) = it {
            f.attrs.retain(|a| {
                !["constructor", "async_execution", "skip"]
                    .iter()
                    .any(|n| a.path().is_ident(n))
            });
        }
    }
}

fn expand_class(attr: TokenStream2, item: &mut ItemImpl) -> syn::Result<TokenStream2> {
    if !attr.is_empty() {
        return Err(syn::Error::new_spanned(
            attr,
            "#[remote_class] takes no arguments",
        ));
    }
    if let Some((_, path, _)) = &item.trait_ {
        return Err(syn::Error::new_spanned(
            path,
            "#[remote_class] goes on an inherent impl, not a trait impl",
        ));
    }
    if !item.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &item.generics,
            "a #[remote_class] cannot be generic",
        ));
    }
    let class_ty = (*item.self_ty).clone();
    let class = match &class_ty {
        Type::Path(p) if p.qself.is_none() => match p.path.segments.last() {
            Some(seg) if seg.arguments.is_empty() => seg.ident.to_string(),
            _ => {
                return Err(syn::Error::new_spanned(
                    &class_ty,
                    "a #[remote_class] must be a plain type name",
                ));
            }
        },
        _ => {
            return Err(syn::Error::new_spanned(
                &class_ty,
                "a #[remote_class] must be a plain type name",
            ));
        }
    };

    let mut wrappers = Vec::new();
    let mut records = vec![plugin_record()];
    let mut constructor: Option<Span> = None;
    let mut errors: Option<syn::Error> = None;
    let mut push_err = |e: syn::Error| match &mut errors {
        Some(all) => all.combine(e),
        None => errors = Some(e),
    };

    for (index, it) in item.items.iter_mut().enumerate() {
        let ImplItem::Fn(f) = it else { continue };
        let ctor_flag = take_flag(f, "constructor");
        let async_flag = take_flag(f, "async_execution");
        if take_flag(f, "skip").is_some() {
            continue;
        }
        let receiver = match f.sig.inputs.first() {
            Some(FnArg::Receiver(r)) => Some(r.clone()),
            _ => None,
        };
        let role = match (&ctor_flag, &receiver) {
            (Some(span), None) => {
                if constructor.is_some() {
                    push_err(syn::Error::new(
                        *span,
                        "a #[remote_class] has exactly one #[constructor]",
                    ));
                    continue;
                }
                if let Some(span) = async_flag {
                    push_err(syn::Error::new(
                        span,
                        "a #[constructor] cannot be #[async_execution]",
                    ));
                    continue;
                }
                constructor = Some(*span);
                Role::Constructor
            }
            (Some(_), Some(r)) => {
                push_err(syn::Error::new_spanned(
                    r,
                    "a #[constructor] takes no `self`",
                ));
                continue;
            }
            (None, Some(r)) => {
                if r.reference.is_none() || r.colon_token.is_some() {
                    push_err(syn::Error::new_spanned(
                        r,
                        "methods take `&self` or `&mut self`: the object stays in its instance",
                    ));
                    continue;
                }
                Role::Method
            }
            (None, None) => Role::Static,
        };
        let params = match check_signature(&f.sig, "a #[remote_class] function") {
            Ok(p) => p,
            Err(e) => {
                push_err(e);
                continue;
            }
        };
        let is_async = async_flag.is_some();
        let fn_ident = &f.sig.ident;
        let method = fn_ident.to_string();
        let names: Vec<String> = params.iter().map(|p| p.name.clone()).collect();
        let idents: Vec<&Ident> = params.iter().map(|p| &p.ident).collect();
        let binds = bind_args(&params);
        let wrapper = format_ident!("__wasmrpc_export_{}", index);
        let (kind, export_class, entry_name, err_name) = match role {
            Role::Constructor => (
                ExportKind::Constructor,
                Some(class.clone()),
                class.clone(),
                class.clone(),
            ),
            Role::Method if is_async => (
                ExportKind::AsyncMethod,
                Some(class.clone()),
                method.clone(),
                method.clone(),
            ),
            Role::Method => (
                ExportKind::Method,
                Some(class.clone()),
                method.clone(),
                method.clone(),
            ),
            Role::Static if is_async => (
                ExportKind::AsyncFunction,
                None,
                format!("{class}.{method}"),
                method.clone(),
            ),
            Role::Static => (
                ExportKind::Function,
                None,
                format!("{class}.{method}"),
                method.clone(),
            ),
        };
        let export = export_name(kind, export_class.as_deref(), &entry_name);
        let body = match role {
            Role::Constructor => quote! {
                let __wasmrpc_object: #class_ty =
                    ::wasmrpc_guest::__private::IntoObject::<#class_ty>::into_object(
                        <#class_ty>::#fn_ident(#(#idents),*)
                    )?;
                ::core::result::Result::Ok(::wasmrpc_guest::__private::new_object::<#class_ty>(__wasmrpc_object))
            },
            Role::Method => {
                let out = outcome(
                    &f.sig.output,
                    is_async,
                    quote!(<#class_ty>::#fn_ident(__wasmrpc_this, #(#idents),*)),
                );
                quote! {
                    ::wasmrpc_guest::__private::with_object::<#class_ty>(__wasmrpc_object_id, #class, |__wasmrpc_this| {
                        ::core::result::Result::Ok(#out)
                    })
                }
            }
            Role::Static => {
                let out = outcome(
                    &f.sig.output,
                    is_async,
                    quote!(<#class_ty>::#fn_ident(#(#idents),*)),
                );
                quote!(::core::result::Result::Ok(#out))
            }
        };
        wrappers.push(quote! {
            #[unsafe(export_name = #export)]
            extern "C" fn #wrapper(__wasmrpc_object_id: u32, len: u32) -> u64 {
                let _ = __wasmrpc_object_id;
                ::wasmrpc_guest::__private::run(#err_name, &[#(#names),*], len, |__wasmrpc_args| {
                    #binds
                    #body
                })
            }
        });
        records.push(Record::Export(Export {
            name: entry_name,
            kind,
            class: export_class,
            params: names,
        }));
    }
    if constructor.is_none() {
        push_err(syn::Error::new_spanned(
            &class_ty,
            "a #[remote_class] needs one function marked #[constructor]",
        ));
    }
    if let Some(e) = errors {
        return Err(e);
    }
    let drop_export = drop_export_name(&class);
    let manifest = manifest_static(&records, class_ty.span())?;
    Ok(quote! {
        #item
        #[doc(hidden)]
        const _: () = {
            #(#wrappers)*
            #[unsafe(export_name = #drop_export)]
            extern "C" fn __wasmrpc_drop(object: u32, _len: u32) -> u64 {
                ::wasmrpc_guest::__private::drop_object(object)
            }
            #manifest
        };
    })
}
